"""Tools for developers, not for serving: `prism model build`'s tiny random-weight models
and real-size presets (they import torch and transformers)."""
