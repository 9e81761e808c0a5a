"""The LLM gateway: an OpenAI-compatible chat-completions client and ``gen-cases`` on top of it."""
