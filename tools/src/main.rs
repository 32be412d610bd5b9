//! `llms`: the one command-line tool of the project (model, generate, chat, eval, bench).
#![allow(clippy::print_stdout, clippy::print_stderr)]

fn main() {
    println!("llms");
}
