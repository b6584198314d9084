"""The application: the ``weighbridge`` command (``cli``), the demo (``demo``), the local stack
(``stack``), one load run (``loadrun``) and the simulator (``simulation``), on top of the parts
(docs/architecture.md)."""
