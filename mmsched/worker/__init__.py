"""The tokenizer worker (``mmsched worker``): OpenAI-style HTTP in front, mmsched behind.

``prep`` turns a chat request into input ids and pixel values (pure, no I/O); ``app``
serves HTTP (aiohttp) and talks to mmsched through ``mmsched.client``.
"""
