"""The planner-accuracy helpers live in planner_helpers.py beside the tests."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # planner_helpers
