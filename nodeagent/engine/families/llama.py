"""Llama, Mistral and Qwen2: the `Family` base itself, under its registry name."""

from __future__ import annotations

from nodeagent.engine.families.base import Family


class Llama(Family):
    """Llama 2 and 3.x, Mistral (a window on every layer), Qwen2 (q/k/v biases, windows from
    `max_window_layers`)."""
