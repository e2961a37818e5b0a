"""L3 page storage backends: Redis and local files, behind one batch interface.

``create_storage_backend("redis", "redis://host:6379/0", prefix=...)`` or
``create_storage_backend("file", "/path/to/dir", max_bytes=...)``; see
``base`` for the failure contract (storage never fails a request).
"""

from .base import (DEFAULT_MAX_VALUE_BYTES, BackendHealth, StorageArgumentError, StorageBackend,
                   create_storage_backend, register_storage_backend, storage_backend_names)
from .file_backend import FileStorage

try:
    from .redis_backend import RedisStorage
except ImportError as e:  # redis-py absent (a bare GPU image): only "redis" is unavailable
    RedisStorage = None  # type: ignore[assignment,misc]
    REDIS_IMPORT_ERROR: ImportError | None = e
else:
    REDIS_IMPORT_ERROR = None

__all__ = ["DEFAULT_MAX_VALUE_BYTES", "BackendHealth", "StorageArgumentError", "StorageBackend",
           "create_storage_backend", "register_storage_backend", "storage_backend_names",
           "FileStorage", "RedisStorage"]
