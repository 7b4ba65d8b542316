"""Anthropic's Messages API (`POST /v1/messages`) over the processor's chat call."""
