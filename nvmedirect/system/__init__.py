"""The system side of nvmedirect: find NVMe controllers, judge whether taking one is safe, check
readiness, plan and apply system configuration, and bind/restore controllers with a state file.

Everything reads the machine through a `SystemView` rooted at a directory (the real `/` by
default), so the same code runs against fake trees in tests.
"""

from nvmedirect.system.devices import Controller, Namespace, TargetError, list_controllers, resolve_target
from nvmedirect.system.safety import Verdict, assess
from nvmedirect.system.sysview import SystemView
from nvmedirect.system.usage import UsageIndex

__all__ = ["Controller", "Namespace", "SystemView", "TargetError", "UsageIndex", "Verdict", "assess",
           "list_controllers", "resolve_target"]
