"""The web view at /ui (docs/web-view.md): server-rendered page shells whose data comes from the /v1 API."""
