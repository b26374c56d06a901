// A small Markdown renderer for chat answers: fenced code blocks, inline code, bold and italic, headings,
// lists, block quotes, horizontal rules and links. The text is HTML-escaped before any markup is added, so
// model output can never become markup of its own; links keep only http(s) and mailto targets.
// An unclosed code fence (an answer still streaming) runs to the end of the text.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// Inline markup of one escaped line: code spans first (their content stays literal), then links, bold, italic.
function inline(escaped) {
  const codes = [];
  let s = escaped.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => {
    codes.push(`<code>${code}</code>`);
    return `\u0000${codes.length - 1}\u0000`;
  });
  s = s.replace(/\[([^\]]+)\]\(((?:https?:\/\/|mailto:)[^\s)]+)\)/g,
    (_, label, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
  s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/__(?=\S)([\s\S]*?\S)__/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*(?=\S)([^*]*?\S)\*(?!\*)/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^_\w])_(?=\S)([^_]*?\S)_(?![_\w])/g, "$1<em>$2</em>");
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => codes[Number(i)]);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^(\s*)([-*+])\s+(.*)$/;
const NUMBERED = /^(\s*)(\d{1,9})[.)]\s+(.*)$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}&gt;\s?(.*)$/;

export function renderMarkdown(text) {
  const lines = escapeHtml(text).split("\n");
  const out = [];
  let para = [];
  let list = null; // {tag, items: [html]}

  const flushPara = () => {
    if (para.length) out.push(`<p>${inline(para.join("\n"))}</p>`);
    para = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}${list.start > 1 ? ` start="${list.start}"` : ""}>` +
      list.items.map((item) => `<li>${inline(item)}</li>`).join("") + `</${list.tag}>`);
    list = null;
  };
  const flush = () => { flushPara(); flushList(); };

  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      flush();
      const close = new RegExp(`^ {0,3}${fence[1][0] === "`" ? "`" : "~"}{${fence[1].length},}\\s*$`);
      const code = [];
      for (i++; i < lines.length && !close.test(lines[i]); i++) code.push(lines[i]);
      const lang = fence[2] ? ` class="language-${fence[2]}"` : "";
      out.push(`<pre><code${lang}>${code.join("\n")}</code></pre>`);
      continue;
    }
    if (!line.trim()) { flush(); continue; }
    const heading = line.match(HEADING);
    if (heading) {
      flush();
      const level = heading[1].length;
      out.push(`<h${level}>${inline(heading[2])}</h${level}>`);
      continue;
    }
    if (RULE.test(line) && !para.length) { flush(); out.push("<hr>"); continue; }
    const quote = line.match(QUOTE);
    if (quote) {
      flush();
      const quoted = [quote[1]];
      while (i + 1 < lines.length && QUOTE.test(lines[i + 1])) quoted.push(lines[++i].match(QUOTE)[1]);
      out.push(`<blockquote>${inline(quoted.join("\n"))}</blockquote>`);
      continue;
    }
    const bullet = line.match(BULLET);
    const numbered = bullet ? null : line.match(NUMBERED);
    if (bullet || numbered) {
      flushPara();
      const tag = bullet ? "ul" : "ol";
      if (!list || list.tag !== tag) {
        flushList();
        list = { tag, items: [], start: numbered ? Number(numbered[2]) : 1 };
      }
      list.items.push((bullet || numbered)[3]);
      continue;
    }
    if (list && /^\s+\S/.test(line)) { // a list item's continuation line
      list.items[list.items.length - 1] += "\n" + line.trim();
      continue;
    }
    flushList();
    para.push(line);
  }
  flush();
  return out.join("\n");
}
