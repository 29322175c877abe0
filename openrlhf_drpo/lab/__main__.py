from openrlhf_drpo.lab.driver import console_main

console_main()
