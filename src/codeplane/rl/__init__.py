"""Reinforcement learning for the coding agent over the product's own tools and sandboxes.

Installed with `pip install -e '.[rl]'` (ray, torch, transformers, peft); nothing in the default
install imports this package. The seams between its parts are in `types.py`.
"""
