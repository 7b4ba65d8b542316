"""Prism's one door to vLLM: the modules that import vLLM, its private calls included, live
here and nowhere else (`make lint` holds every other module to it)."""
