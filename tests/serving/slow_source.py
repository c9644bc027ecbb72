"""An injected fault for the hot-swap test: an adapter source that takes `delay` seconds to fetch.

It lives in an importable module (not a test file) because the loader process unpickles it.
"""

import time
from dataclasses import dataclass
from pathlib import Path

from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.serving.sources import DirectorySource


@dataclass(frozen=True)
class SlowSource:
    inner: DirectorySource
    delay: float

    def load(self, scratch: Path, config: InklingTextConfig) -> Adapter:
        time.sleep(self.delay)
        return self.inner.load(scratch, config)
