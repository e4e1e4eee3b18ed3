"""The demo (`rollstream demo`): the whole system on one machine, with a policy that really learns.

    from rollstream.demo import DemoOptions, run_demo

`run_demo` (`_run.py`) wires both sides together; its parts: the task and the demo model
(`rollstream.demo.task`: addition prompts, their reward, a small model built locally), the GRPO learner
(`rollstream.demo.trainer`), what generates (`_engines.py`), the broker and the producer processes
(`_services.py`), the progress table and plot (`_display.py`), the result and its summary (`_result.py`).

The names below are loaded on first use (PEP 562), so a producer that scores with
``rollstream.demo.task:reward``, or a trainer that imports `rollstream.demo.trainer`, loads only that module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollstream._lazy import lazy_attributes

# the module that defines each public name (loaded on first use by __getattr__ below)
_MODULE_OF = {
    "DemoError": "rollstream.demo._services",
    "DemoOptions": "rollstream.demo._run",
    "DemoResult": "rollstream.demo._result",
    "run_demo": "rollstream.demo._run",
}

__all__ = ["DemoError", "DemoOptions", "DemoResult", "run_demo"]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads the same names
    from rollstream.demo._result import DemoResult
    from rollstream.demo._run import DemoOptions, run_demo
    from rollstream.demo._services import DemoError

__getattr__, __dir__ = lazy_attributes("rollstream.demo", _MODULE_OF, globals())
