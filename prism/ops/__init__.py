"""Running Prism rather than serving with it: the plan of a mode's stages, `prism serve`'s
launcher and supervisor, GPU placement, the demo, and `prism deploy`'s manifests. Nothing
on the serving path imports from here."""
