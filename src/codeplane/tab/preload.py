"""The Tab model loaded before the first request after `codeplane serve` starts (issue 34
item 7: that request should answer within 2 s).

A starting server on a loaded 2-core machine spends seconds importing its modules before
its port opens (docs/tab.md, "The first suggestion in a file"). Loading the Tab model only
once the server is up left the first request waiting for the weights and the vocabulary
index behind the open port. So `codeplane serve` starts both first, here - this module
imports only settings and the engine - and they load while the server's modules do; the
server's own warm-up (`TabService.warm`) then finds them done and decodes once, yielding to
any request.
"""

from __future__ import annotations

from concurrent.futures import Future

from codeplane.config import Settings
from codeplane.models.engine import Engine


def preloaded(settings: Settings) -> bool:
    """Whether a starting server loads the Tab model before any request: codeplane.toml (or
    the environment) sets a key of `[tab]`, `preload` is on, and Tab's model calls go to
    the embedded engine, not an upstream."""
    tab = settings.tab
    return bool(tab.model_fields_set) and tab.preload and not tab.upstream


def start(settings: Settings, engine: Engine) -> Future | None:
    """Start loading the Tab model's weights and building what every Tab request needs in
    its worker (the job `tab.state`), and return at once (None: nothing to preload). No
    request can be waiting for it: the caller has not opened its port yet."""
    if not preloaded(settings):
        return None
    return engine.submit(settings.tab.model, "tab.state", settings.tab)
