"""The sandbox: warm fork servers whose children run untrusted code (a task's, a
candidate's) confined, with a framed wire format back to the parent.

Used by the worker (verification) and by the generator and the SDK (the built-in
coder's lowering). It imports none of them and names none of their roles: a *role*
(what a child runs once it is confined) is registered by whoever owns it, with its
runner's dotted path, its messages and its row of the limits table
(:func:`services.sandbox.roles.register_role`); the child imports that runner only
after entering the sandbox.

- :mod:`~services.sandbox.pool`: :class:`~services.sandbox.pool.Sandbox`, what its
  users hold (a fork server and what it learned this machine permits);
- :mod:`~services.sandbox.server`: the fork server from its parent's side, and
  :mod:`~services.sandbox.forkserver`, the fork server process;
- :mod:`~services.sandbox.channel`: one child from its parent's side (frames, exit,
  cleanup); :mod:`~services.sandbox.errors`: what the sandbox raises;
- :mod:`~services.sandbox.hardening` / :mod:`~services.sandbox.isolation`: what a
  child does to itself before any untrusted code runs;
- :mod:`~services.sandbox.guard`: the in-process guards a child installs;
- :mod:`~services.sandbox.limits`: the one table of resource limits;
- :mod:`~services.sandbox.wire` / :mod:`~services.sandbox.values`: the generic frames
  (spec, hello, progress, failure, done) and the encoding of tensors and value trees;
- :mod:`~services.sandbox.child`: a child's entry and the helpers role runners share;
- :mod:`~services.sandbox.roles`: the role registry;
- :mod:`~services.sandbox.interpreter` / :mod:`~services.sandbox.numerics`: Triton's
  cpu interpreter computing as a GPU does.
"""
