"""The agent endpoint: an OpenAI-compatible chat server (:mod:`.openai_server`) through which an external
agent drives an episode, its conversations turned into token-exact engine requests (:mod:`.gateway`,
:mod:`.conversation`), configured by :mod:`.config`."""
