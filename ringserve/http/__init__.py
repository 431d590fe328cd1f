"""The HTTP API served on rank 0 (`create_app` in `ringserve.http.app`)."""
