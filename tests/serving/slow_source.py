"""An injected fault for the hot-swap test: an adapter source that takes `delay` seconds to fetch.

It lives in an importable module (not a test file) because the loader process unpickles it.
"""

import time
from dataclasses import dataclass
from pathlib import Path

from inkwell.serving.sources import DirectorySource


@dataclass(frozen=True)
class SlowSource:
    inner: DirectorySource
    delay: float

    def fetch(self, scratch: Path) -> Path:
        time.sleep(self.delay)
        return self.inner.fetch(scratch)
