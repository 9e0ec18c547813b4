"""The sandbox: warm fork servers whose children run untrusted code (a task's, a
candidate's) confined, with a framed wire format back to the parent.

Used by the worker (references, candidates, replays, GPU compiles), the generator and
the SDK (the built-in coder's lowering). It imports neither of them: a *role* (what
a child runs once it is confined) is registered by dotted path
(:func:`services.sandbox.roles.register_role`) by whoever owns it, and the child
imports that runner only after entering the sandbox.

- :mod:`~services.sandbox.pool`: :class:`~services.sandbox.pool.Sandbox` (a fork
  server and what it learned this machine permits) and the pool that spawns children;
- :mod:`~services.sandbox.forkserver`: the fork server process;
- :mod:`~services.sandbox.hardening` / :mod:`~services.sandbox.isolation`: what a
  child does to itself before any untrusted code runs;
- :mod:`~services.sandbox.guard`: the in-process guards a child installs;
- :mod:`~services.sandbox.limits`: the one table of per-role resource limits;
- :mod:`~services.sandbox.wire` / :mod:`~services.sandbox.values`: the frames and
  the encoding of tensors and value trees;
- :mod:`~services.sandbox.child`: a child's entry and the helpers role runners share;
- :mod:`~services.sandbox.roles`: the role registry.
"""
