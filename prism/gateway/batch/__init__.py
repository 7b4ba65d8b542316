"""OpenAI's Batch API: files of requests answered beneath the interactive traffic."""
