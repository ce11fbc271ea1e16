//! `cargo run -p codegen`: regenerates everything under `generated/` and prints a summary.

fn main() {
    let run = || -> Result<(), codegen::CodegenError> {
        let files = codegen::generate()?;
        let dir = codegen::generated_dir();
        codegen::write_all(&dir, &files)?;
        for k in codegen::build_all()? {
            println!("{}", codegen::summary::one_line(&k));
        }
        println!("wrote {} files to {}", files.len(), dir.display());
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("codegen failed: {e}");
        std::process::exit(1);
    }
}
