"""Websocket typeahead demo: a page that searches the catalog on every keystroke through the sidecar."""
