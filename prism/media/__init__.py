"""Media: what a request brings besides text, fetched, checked and described per modality.

`modality.py` is the shape every modality has; `image.py`, `video.py` and `embeds.py`
(image embeddings a client computed) are the modalities, and `modalities.py` the registry
that the processor, the encoder and the workers iterate over. `fetch.py` loads files from
http(s) and data URLs behind `url_guard.py`; `policy.py` holds the caps one request may
bring. This package stays free of vLLM: decoding goes through `prism.engine.media_io`.
"""
