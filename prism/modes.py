"""The deployment modes: the roles a request passes through, in order, after the processor."""

ROLES = {
    "epd": ("worker",),
    "e/pd": ("encoder", "worker"),
}
MODES = tuple(ROLES)
