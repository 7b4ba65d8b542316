"""The OpenAI REST API: one module per endpoint, and what they share (`protocol`)."""
