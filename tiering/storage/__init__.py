"""L3 page storage backends: Redis and local files, behind one batch interface.

``create_storage_backend("redis", "redis://host:6379/0", prefix=...)`` or
``create_storage_backend("file", "/path/to/dir", max_bytes=...)``; see
``base`` for the failure contract (storage never fails a request).
"""

from .base import (DEFAULT_MAX_VALUE_BYTES, BackendHealth, StorageArgumentError, StorageBackend,
                   create_storage_backend, register_storage_backend, storage_backend_names)
from .file_backend import FileStorage
from .redis_backend import RedisStorage

__all__ = ["DEFAULT_MAX_VALUE_BYTES", "BackendHealth", "StorageArgumentError", "StorageBackend",
           "create_storage_backend", "register_storage_backend", "storage_backend_names",
           "FileStorage", "RedisStorage"]
