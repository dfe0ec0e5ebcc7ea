// maxent-arrow view: the token tooltip (the pages work without this script).
"use strict";
(function () {
  function show(tip, tok, event) {
    var info = JSON.parse(tok.getAttribute("data-info"));
    var lines = ["token " + info.t + "  id " + info.id];
    if (info.piece !== undefined) lines.push("piece: " + info.piece);
    Object.keys(info).forEach(function (k) {
      if (k === "t" || k === "id" || k === "piece") return;
      var v = info[k];
      lines.push(k + ": " + (v === null ? "–" : Number(v).toPrecision(5)));
    });
    tip.textContent = lines.join("\n");
    tip.hidden = false;
    tip.style.left = event.clientX + 12 + "px";
    tip.style.top = event.clientY + 12 + "px";
  }
  document.addEventListener("DOMContentLoaded", function () {
    var tip = document.getElementById("tip");
    var tokens = document.getElementById("tokens");
    if (!tip || !tokens) return;
    tokens.addEventListener("mouseover", function (event) {
      var tok = event.target.closest(".tok");
      if (tok) { tok.classList.add("hover"); show(tip, tok, event); }
    });
    tokens.addEventListener("mouseout", function (event) {
      var tok = event.target.closest(".tok");
      if (tok) tok.classList.remove("hover");
      tip.hidden = true;
    });
  });
})();
