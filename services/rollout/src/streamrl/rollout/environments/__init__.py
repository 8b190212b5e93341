"""Multi-turn episodes: the environment protocol (:mod:`.environment`), the built-in calculator
(:mod:`.calculator`), and the episode that alternates engine turns and environment steps (:mod:`.episode`)."""
