"""Privacy-preserving graph expansion: keyed item tokens, the third-party service, its client."""

from .client import NeighbourClient, NeighbourServiceError
from .service import ADMIN_TOKEN_ENV, Limits, NeighbourService, RequestError, serve
from .tokens import item_tokens, new_handle, new_run_key

__all__ = ["ADMIN_TOKEN_ENV", "Limits", "NeighbourClient", "NeighbourService", "NeighbourServiceError", "RequestError",
           "item_tokens", "new_handle", "new_run_key", "serve"]
