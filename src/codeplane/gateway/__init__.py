"""The model gateway: one reliable OpenAI-compatible API over local and remote deployments.

`Gateway` (router.py) owns deployments, routing, retries, fallbacks, circuit breakers and slow
start; `admission.py` owns priority queues and rate limits; `keys.py` the server-issued API
keys; `providers/` speak each upstream's protocol.
"""
