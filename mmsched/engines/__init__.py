"""Engines that ship with mmsched, each a plug-in like any other (``--engine module:factory``)."""
