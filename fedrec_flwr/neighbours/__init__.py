"""Privacy-preserving graph expansion: keyed item tokens, the third-party service, its client."""

from .client import NeighbourClient, NeighbourServiceError
from .limits import Limits, RequestError
from .server import serve
from .service import NeighbourService
from .tokens import item_tokens, new_handle, new_run_key

__all__ = ["Limits", "NeighbourClient", "NeighbourService", "NeighbourServiceError", "RequestError", "item_tokens",
           "new_handle", "new_run_key", "serve"]
