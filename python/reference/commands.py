"""Several commands in one process: the reference scripts take commands separated by a lone
`;` argument (`\\;` in a shell) and run them in order. Importing torch and transformers costs
more CPU than most commands (10 s on a 2-core VM), and the tests run dozens of them."""


def split(argv):
    """argv split at each lone ";"."""
    commands = [[]]
    for word in argv:
        if word == ";":
            commands.append([])
        else:
            commands[-1].append(word)
    return commands
