"""weight_sync."""
