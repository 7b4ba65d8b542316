"""OpenAI's Responses API: its items as chat messages, its answer and events, its store."""
