// Hugging Face's own tokenizers, as the reference the compatibility test (hf_compat_test.py)
// compares tetra against: `tokenizers` (HF's Node binding of the Rust library, whose ByteLevel
// pre-tokenizer runs GPT-2's pattern through Oniguruma) and `@huggingface/tokenizers` (the pure
// JavaScript port that transformers.js uses to load a model directory).
//
//   node hf_tokenizers.js NODE_MODULES REQUEST.json RESPONSE.json
//
// Requests:
//   {"op": "pieces", "text_file": F}
//       -> {"lengths": [...]}: byte length of each piece of ByteLevel(use_regex) pre-tokenization
//   {"op": "encode", "tokenizer": F, "texts": [...], "config": F or null}
//       -> {"rust": [[ids]], "js": [[ids]], "decoded": [...]}: ids from both implementations
//          (special tokens matched, as by default), the Rust decoder's text of the Rust ids
//   {"op": "load_dir", "dir": D, "texts": [...]}
//       -> tokenizer.json + tokenizer_config.json through the JS port's Tokenizer, as
//          transformers.js loads a model directory: bos/eos tokens and ids, and the ids of texts
"use strict";
const fs = require("fs");
const path = require("path");

async function main() {
  const [modules, requestFile, responseFile] = process.argv.slice(2);
  const rust = require(path.join(modules, "tokenizers"));
  const js = require(path.join(modules, "@huggingface/tokenizers"));
  const req = JSON.parse(fs.readFileSync(requestFile, "utf8"));
  let res;
  if (req.op === "pieces") {
    const text = fs.readFileSync(req.text_file, "utf8");
    const pre = rust.byteLevelPreTokenizer(false, true);
    // Each byte is one character of the byte-level alphabet, so a piece's length is its bytes.
    res = {lengths: pre.preTokenizeString(text).map(([piece]) => [...piece].length)};
  } else if (req.op === "encode") {
    const tok = rust.Tokenizer.fromFile(req.tokenizer);
    const encodings = await tok.encodeBatch(req.texts, {addSpecialTokens: false});
    const ids = encodings.map((e) => e.getIds());
    const config = req.config ? JSON.parse(fs.readFileSync(req.config, "utf8")) : {};
    const port = new js.Tokenizer(JSON.parse(fs.readFileSync(req.tokenizer, "utf8")), config);
    res = {
      rust: ids,
      js: req.texts.map((t) => port.encode(t, {add_special_tokens: false}).ids),
      decoded: await tok.decodeBatch(ids, false),
    };
  } else if (req.op === "load_dir") {
    const read = (f) => JSON.parse(fs.readFileSync(path.join(req.dir, f), "utf8"));
    const config = read("tokenizer_config.json");
    const port = new js.Tokenizer(read("tokenizer.json"), config);
    res = {
      bos_token: config.bos_token,
      eos_token: config.eos_token,
      bos_id: port.token_to_id(config.bos_token),
      eos_id: port.token_to_id(config.eos_token),
      ids: req.texts.map((t) => port.encode(t, {add_special_tokens: false}).ids),
      decoded: req.texts.map((t) => port.decode(port.encode(t).ids)),
    };
  } else {
    throw new Error(`unknown op ${req.op}`);
  }
  fs.writeFileSync(responseFile, JSON.stringify(res));
}

main().catch((e) => {
  console.error(`[hf_tokenizers] ${e.stack || e}`);
  process.exit(1);
});
