"""Deployment manifests of a mesh."""
