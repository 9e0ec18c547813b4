"""Coders: what turns a task into candidate kernel source (the built-in coder, whose
lowering is :mod:`services.generator.lowering`; the LLM coder lives in
:mod:`services.generator.agents`)."""
