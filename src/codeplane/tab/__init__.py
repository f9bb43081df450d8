"""Tab: inline code completion on every keystroke (server service, client context, LSP)."""
