class TokensPrompt(dict):
    pass
