"""The mapping of one emitted step's metrics that every adapter's ``write`` receives: one dict, shared by every
adapter's thread, so none may change it."""

from __future__ import annotations

from typing import Any, NoReturn

_REFUSED = "an emitted step's metrics are shared by every adapter and read-only: copy them with dict(metrics)"


class StepMetrics(dict[str, float]):
    """A dict that refuses changes. ``dict(metrics)`` or ``metrics.copy()`` gives a plain dict to change, at a
    dict's copying speed (a ``MappingProxyType``, the read-only view it replaces, copies through the mapping
    protocol: 4 µs against 0.24 µs for 100 floats). Pickles (and ``copy.copy``) as a plain dict."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(_REFUSED)

    # every dict method that changes the dict in place
    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple[type[dict[str, float]], tuple[dict[str, float]]]:
        return dict, (dict(self),)
