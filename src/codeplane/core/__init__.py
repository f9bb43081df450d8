"""The bottom layer every compartment may import: the OpenAI-shaped error envelope (`errors`),
OpenAI wire schemas (`schemas`) and Prometheus metrics (`metrics`).

It imports no compartment, so `server/` stays the top (it composes everything) and nothing
below it has to reach up into it.
"""
