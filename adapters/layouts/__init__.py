"""On-disk layouts of one adapter: the tensor names and shapes a consumer loads.

`Layout` / `LAYOUTS` are the one list of layouts; each has a module here (`sglang`, `peft`). This package
imports none of them, so the layout names cost no torch import (the SDK reads them through the API schemas).
"""

from typing import Literal, get_args

Layout = Literal["sglang", "peft"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
