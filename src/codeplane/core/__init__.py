"""The bottom layer every compartment may import: the OpenAI-shaped error envelope (`errors`),
OpenAI wire schemas (`schemas`), Prometheus metrics (`metrics`), confined file access and the
lossless text codec (`files`), and the languages of source files (`languages`).

It imports no compartment, so `server/` stays the top (it composes everything) and nothing
below it has to reach up into it (the layer order: tests/test_layers.py).
"""
