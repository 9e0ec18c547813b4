"""Coders: what turns a task into candidate kernel source (built-in lowering; the LLM
coder lives in :mod:`services.generator.agents`)."""
