"""State transfer: a joiner downloads the training state from a member (:mod:`.download`), every trainer serves
its own (:mod:`.server`), and both check what crosses the wire against the manifest (:mod:`.manifest`)."""
