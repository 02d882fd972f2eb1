"""The process a Checkpointer lives in: the writer's lock file, exit and fork hooks, preemption signals, and
the safe points where a preemption saves at once.

Owns lockfile.py, lifecycle.py, preemption.py, preempt_points.py. May import: ``state.errors`` only (the
bottom layer; a Checkpointer is reached through protocols defined here, such as preempt_points.py's
``SafePointSaver``).
"""
