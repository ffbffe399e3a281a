"""Engine plug-ins: ``hf`` (a transformers vision-language model, extra ``mmsched[hf]``)."""
