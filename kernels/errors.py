"""The root of Nibble's one exception hierarchy.

It lives here because ``nibble.kernels`` imports nothing else of Nibble's,
while every other package may import kernels. ``nibble.services.errors``
re-exports these roots and adds the service-level errors.

* ``NibbleError``: everything Nibble raises on purpose.
* ``RetryableError``: transient, a retry may succeed.
* ``FatalError``: permanent, retrying will not help.
"""


class NibbleError(Exception):
    """Root of every error Nibble raises on purpose."""


class RetryableError(NibbleError):
    """Transient: retrying later may succeed (maps to 503 / UNAVAILABLE)."""


class FatalError(NibbleError):
    """Permanent: retrying will not help."""


class KernelInputError(NibbleError, ValueError):
    """A tensor argument has the wrong shape, dtype, device or contents."""


class NonFiniteInputError(KernelInputError):
    """A value to be quantized is NaN or infinite."""
