"""lorafn.store: the one module that knows the Redis keys, the stream protocol and the Lua scripts.

Imports no other lorafn package: functions are plain `namespace/name` strings, specs plain dicts.
Operations (`Op`) are written once and run on a sync `Store` or an asyncio `AsyncStore`.
"""

from lorafn.store.client import UNAVAILABLE_ERRORS, AsyncStore, Op, Store, combine
from lorafn.store.keys import GROUP, Keys, check_function

__all__ = ["GROUP", "UNAVAILABLE_ERRORS", "AsyncStore", "Keys", "Op", "Store", "check_function", "combine"]
