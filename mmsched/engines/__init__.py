"""Engines that ship with mmsched, each a plug-in like any other (``--engine module:factory``):
``reference`` (the default) and ``hf`` (a transformers vision-language model, extra ``mmsched[hf]``)."""
