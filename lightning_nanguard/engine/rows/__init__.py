"""Which rows of a bad batch an event names: positions, loaders, dataset indices and records.

``samples.py`` fills an event from a diagnosis (positions per loader, the samples a bundle and the
dashboard keep); ``record_names.py`` names the records of the offending rows and checks them by reading
them again (:mod:`lightning_nanguard.diagnose.reread` at an incident).
"""
